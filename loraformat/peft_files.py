"""The files of a PEFT adapter directory, as `save_pretrained` writes them, and the refusal of pickles.

Pure: standard library only, so the registry, the engine and the command-line client all import it.
"""

from __future__ import annotations

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
ADAPTER_FILES = (CONFIG_FILE, WEIGHTS_FILE)
# Where PEFT saves pickle weights instead (safe_serialization=False); looked for only to refuse them.
PICKLE_WEIGHTS_FILES = ("adapter_model.bin", "adapter_model.pt")
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".ckpt")


def is_pickle_weights(filename: str) -> bool:
    return filename.lower().endswith(PICKLE_SUFFIXES)


def pickle_refusal(filename: str) -> str:
    """The message that refuses pickle weights `filename` and says how to convert them."""
    return (
        f"{filename}: pickle weights are refused (loading them can run code); convert it to {WEIGHTS_FILE}, "
        "e.g. `model.save_pretrained(dir, safe_serialization=True)` in PEFT, or "
        f"`safetensors.torch.save_file(torch.load(path), '{WEIGHTS_FILE}')`"
    )
