"""Capture: one training step (forward, backward, optimizer update) as one
`torch.fx` graph, the `Program` the splitter cuts. The functional optimizers
traced into it (`optim`) and the model conversions it takes (TorchRec's
collections) live here too. Nothing here knows processes or modes."""
