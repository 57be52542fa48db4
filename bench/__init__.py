"""``make bench``: the pipeline beside its physical limit (roofline), its practical limit (in-process
batched generation) and the naive unbatched server, on one seeded prompt set, in one run."""
