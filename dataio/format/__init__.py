"""dataio's lowest layer: on-disk formats and pure helpers (the mix file, token files, prepared shards, documents
as index arrays, pieces, packing). Imports nothing else of dataio; reads files, never the network."""
