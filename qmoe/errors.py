"""Errors that mean bad input (config, checkpoint, export, prompt, NaN logits): the CLI prints one line and exits 2."""

from qmoe.checkpoint import CheckpointError
from qmoe.export import ExportError
from qmoe.runtime.generate import GenerationError
from qmoe.settings import ConfigError

BAD_INPUT_ERRORS = (ConfigError, CheckpointError, ExportError, GenerationError)
