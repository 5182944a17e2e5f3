"""The Llama-style model (`llama`), its configs (`config`) and weight loading (`loader`,
`gguf_weights`); what `--model` names (`source`), a GGUF file read (`gguf_file`) and the
tokenizers (`tokenizer`). Import the submodules: `config`, `source`, `gguf_file` and
`tokenizer` need no torch (the router imports them)."""
