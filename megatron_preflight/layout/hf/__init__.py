"""Hugging Face model directories read as checkpoints: their file names and the test that a dir is one
(:mod:`.names`), safetensors headers (:mod:`.safetensors`), ``config.json``
normalised (:mod:`.config`), the one table of names per architecture (:mod:`.families`) and the directory as a
Megatron layout (:mod:`.discover`). JSON only: no pickle, no tensor bytes, no ``transformers``."""
