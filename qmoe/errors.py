"""Errors that mean bad input (config, checkpoint, prompt, NaN logits): the CLI prints one line and exits 2."""

from qmoe.runtime.generate import GenerationError
from qmoe.settings import ConfigError


def _bad_input_errors() -> tuple[type[Exception], ...]:
    errors: list[type[Exception]] = [ConfigError, GenerationError]
    try:
        from qmoe.checkpoint import CheckpointError

        errors.append(CheckpointError)
    except ImportError:
        pass
    try:
        from qmoe.export import ExportError

        errors.append(ExportError)
    except ImportError:
        pass
    return tuple(errors)


BAD_INPUT_ERRORS = _bad_input_errors()
