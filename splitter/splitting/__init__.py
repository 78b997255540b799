"""The split itself: the `GraphSplitter` (one program in, one `SplitPlan` and
the program to run it with out), the labels every node resolves to, and the
`Mode` base every mode refines (its hooks and the typed artifacts a mode hands
the runtime)."""
