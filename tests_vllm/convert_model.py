"""GGUF -> a plain Hugging Face checkpoint that vLLM loads: `convert_model.py GGUF OUT_DIR`.

transformers dequantizes the GGUF tensors (Q4_1 here) into a float32 Llama; the weights are
saved in bf16 with the tokenizer (the chat template also in tokenizer_config.json, where vLLM's
tokenizer looks for it) and the generation config. The GGUF quantization note is dropped from
config.json: the weights written are no longer GGUF. The greedy answer to a fixed question is
checked before the directory is used.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def main(gguf: Path, out: Path) -> None:
    start = time.monotonic()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    # A GGUF-loaded model refuses save_pretrained: copy its weights into a plain one.
    config = loaded.config
    config.dtype = torch.bfloat16
    plain = LlamaForCausalLM(config)
    plain.load_state_dict(loaded.state_dict(), strict=True)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    plain.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    generation = loaded.generation_config
    generation.bos_token_id, generation.eos_token_id, generation.pad_token_id = 1, 2, 2
    generation.save_pretrained(out)

    cfg = json.loads((out / "config.json").read_text())
    cfg.pop("quantization_config", None)
    cfg.pop("_model_name_or_path", None)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    tok_cfg = json.loads((out / "tokenizer_config.json").read_text())
    tok_cfg["model_max_length"] = 8192
    tok_cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    template = out / "chat_template.jinja"
    if template.exists():
        tok_cfg["chat_template"] = template.read_text()
    (out / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2))

    check_tok = AutoTokenizer.from_pretrained(out)
    check = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    inputs = check_tok.apply_chat_template(
        QUESTION, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    ids = check.generate(**inputs, max_new_tokens=20, do_sample=False)
    answer = check_tok.decode(ids[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    print(f"# converted in {time.monotonic() - start:.0f}s: {answer!r}", file=sys.stderr)
    if "Paris" not in answer:
        sys.exit(f"the converted model answers {answer!r}, not Paris")


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
