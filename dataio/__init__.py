"""zerotrain data path: tokenizers, weighted source mixes, the packed-sequence collator.

Three sub-packages, each importing only itself and the ones listed below it (tests/test_architecture.py checks it;
dataio imports neither modeling nor launcher):
    pipeline   loader (a run's batches: sources mixed into packed rows, streaming included), reshard (the
               loader's state on another world size), prepare (`zerotrain prepare`), commands (`zerotrain data ...`)
    sources    reading one source: readers (local files), streamed (record streams), hub (Hub names and snapshots),
               tokenizer (on disk or on the hub), sft (chat and prompt/completion records), holdout (eval rows)
    format     on-disk formats and pure helpers: errors, docstore (documents as index arrays), mix (the mix file),
               tokenfile (flat token files), shards (prepared shards: layout, manifest, checks), pieces, packing
"""
