"""The Llama-style model (`llama`), its configs (`config`), weight loading (`loader`) and
tokenizers (`tokenizer`). Import the submodules: `tokenizer` and `config` need no torch, so the
router can use them."""
