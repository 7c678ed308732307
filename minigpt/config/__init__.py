"""The typed config: schemas (``schema``), value rules and the conversion an entry point does
once (``rules``), and the one-line reports of a bad key or value (``reports``)."""

from minigpt.config.reports import (
    ConfigKeyError,
    added_unknown_keys,
    check_keys,
    closest_key,
    config_errors,
    describe_config_error,
)
from minigpt.config.rules import settings_problems, train_problems, typed
from minigpt.config.schema import (
    EvalCommandSchema,
    EvalSchema,
    GenerateSchema,
    ModelSchema,
    OptimSchema,
    PrepareSchema,
    SampleSchema,
    TrainerSchema,
    TrainSchema,
    VizSchema,
    register_schemas,
)

__all__ = ["ConfigKeyError", "EvalCommandSchema", "EvalSchema", "GenerateSchema", "ModelSchema",
           "OptimSchema", "PrepareSchema", "SampleSchema", "TrainSchema", "TrainerSchema",
           "VizSchema", "added_unknown_keys", "check_keys", "closest_key", "config_errors",
           "describe_config_error", "register_schemas", "settings_problems", "train_problems",
           "typed"]
