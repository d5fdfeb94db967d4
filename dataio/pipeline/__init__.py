"""dataio's top layer: a run's batches (sources mixed into packed rows), their re-split on another world size,
`zerotrain prepare` and `zerotrain data ...`. Imports dataio.sources, dataio.format and itself."""
