"""Loading a target's tokenizer with transformers, and the check that its token ids are the target's: a tokenizer
that will not load, or one that is not the model's, is one TargetConfigError naming its directory. Loading, not
configuration, so it is not in common/config/ (settings as data); here in common/ because producers (the data
they tokenize, the prompts they answer) and drafters (the evaluation) both read a target's tokenizer.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dflash_ring.common.config.target import TargetConfigError


def load_target_tokenizer(path: str | Path) -> Any:
    """The target's tokenizer (and chat template) from its local directory (target.tokenizer, else target.path):
    the one place the project has transformers read a tokenizer, so every command refuses tokenizer files
    transformers will not take (tokenizer.json or tokenizer_config.json not JSON, truncated, not UTF-8, of the
    wrong shape; a special token or setting of the wrong type, caught by encoding a probe text; no tokenizer file
    at all) in one line naming the directory, as TargetConfigError, like common/target_loading.load_target_hf_config
    does for config.json. The chat template's type is checked here too: what renders it expects text."""
    from transformers import AutoTokenizer

    root = Path(path).expanduser()
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(root), local_files_only=True)
        tokenizer("a probe", add_special_tokens=False)  # settings that load yet break encoding (model_max_length)
    except MemoryError:
        raise
    except Exception as e:  # noqa: BLE001 (the reading phase's rule, as load_target_hf_config's)
        why = " ".join(str(e).split())[:500] or "no message"
        raise TargetConfigError(
            f"target tokenizer {root}: transformers cannot load it ({type(e).__name__}: {why}); fix or replace its "
            "tokenizer files (tokenizer.json, tokenizer_config.json, chat_template.jinja) or point "
            "target.tokenizer at another"
        ) from None
    if tokenizer.chat_template:  # none at all: ChatEncoder says what to do
        try:  # the template apply_chat_template renders: a named set's "default"
            template = tokenizer.get_chat_template()
        except ValueError as e:
            template = e
        if not isinstance(template, str):
            what = template if isinstance(template, ValueError) else f"it is a {type(template).__name__}"
            raise TargetConfigError(
                f"target tokenizer {root}: its chat_template is not the text of a Jinja template ({what}); fix "
                "chat_template in tokenizer_config.json (or write chat_template.jinja)"
            )
    return tokenizer


def check_token_ids(max_id: int, vocab_size: int, tokenizer: str | Path, model: str | Path, where: str) -> None:
    """Refuse token ids the target has no embedding row for: a tokenizer that is not the model's (target.tokenizer
    set to another, tokenizer files copied from another model) gives ids past config.json's vocab_size, which the
    model's embedding indexes out of range (a traceback on the CPU, a device-side assert on a GPU)."""
    if max_id >= vocab_size:
        raise TargetConfigError(
            f"{where} holds token id {max_id}, past the {vocab_size} embedding rows of the target {model} "
            f"(config.json vocab_size): the tokenizer {tokenizer} is not this model's; use the model's own"
        )
