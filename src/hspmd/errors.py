"""Typed errors. Each names the offending value and, where one exists, the fix."""


class HspmdError(Exception):
    """Base class of every error this package raises on bad user input."""


class AnnotationError(HspmdError, ValueError):
    """An annotation, DS or device group that is malformed or does not fit a shape."""


class ResolutionError(HspmdError, ValueError):
    """A reshard that cannot be resolved into communication."""


class StrategyError(HspmdError, ValueError):
    """A strategy or plan that cannot work on the given model and ranks."""


class PartitionError(HspmdError, ValueError):
    """A graph or memory cap that the partitioner cannot work with."""
