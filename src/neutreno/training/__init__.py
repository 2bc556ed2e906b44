"""Training: the engine every task shares (:class:`Trainer`, :func:`train`), its configs, the built-in
tasks by name and :func:`register_task` for your own, the loggers its records go to, and the small loops
the demo uses."""

from neutreno.training.engine import OptimConfig, Task, TrainConfig, Trainer, TrainingDiverged, train
from neutreno.training.loggers import (
    LOGGERS,
    JsonlLogger,
    Logger,
    MLflowLogger,
    TensorBoardLogger,
    WandbLogger,
)
from neutreno.training.loop import predict, train_classifier, warmup_cosine
from neutreno.training.tasks import TASKS, load_train_config, register_task, task_classes, train_to_end

__all__ = [
    "LOGGERS",
    "TASKS",
    "JsonlLogger",
    "Logger",
    "MLflowLogger",
    "OptimConfig",
    "Task",
    "TensorBoardLogger",
    "TrainConfig",
    "Trainer",
    "TrainingDiverged",
    "WandbLogger",
    "load_train_config",
    "predict",
    "register_task",
    "task_classes",
    "train",
    "train_classifier",
    "train_to_end",
    "warmup_cosine",
]
