"""Embedding-cache mode: tables on the servers, hot rows cached on every
worker (`mode`), several tables' bags at once (`bag_batching`), and what the
plan says of the cached tables (`summary`)."""
