"""The one rule at the command line's boundary: what ends a command in one line and exit 2.

A `Refusal` is our own verdict on an input (a config file or setting, a model directory, a data set, a run name):
the message says what is wrong and what to do, so cli.main prints it as the command's one error line, exit 2,
whatever layer raised it. The classes that refuse inputs subclass it beside the builtin they always were (a
ValueError: callers that catch that still do). Errors a library raises while reading or building from a user's
file become one where that phase is (common/target_loading.py: load_target_hf_config, building_from and
load_target_lm; common/tokenizer_loading.py: load_target_tokenizer; producer/data_source.py: reading), naming the
file; a ValueError or TypeError from anywhere else is a bug and keeps its traceback.

Besides these, cli.main treats as one line what the operating system and the ring refuse (OSError, TimeoutError,
MemoryError, and the RuntimeErrors of the ring, the roles and the devices: their messages are written as lines).
"""


class Refusal(Exception):
    """An input refused by rule; the message is one line saying what is wrong and what to do."""
