"""The Llama-style model (`llama`), its configs (`config`) and weight loading (`loader`).
Import the submodules: `config` needs no torch. Tokenizers live in `kvconnect.tokenizer`."""
