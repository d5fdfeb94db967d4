"""dataio's middle layer: reading one source (local files, Hub datasets and tokenizers, streamed records, SFT
records, the held-out rows). Imports dataio.format and itself only."""
