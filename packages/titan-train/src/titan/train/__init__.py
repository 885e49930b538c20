"""titan.train: the training engine — config, trainer, data, optimizers, LR schedules, metrics.

Import the pieces from their modules (``titan.train.trainer``, ``titan.train.data``, ...);
this package file stays empty so that importing one piece does not pull in the rest.
"""
