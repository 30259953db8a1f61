"""Typed errors. Each names the offending value and, where one exists, the fix.

Every error raised on bad user input subclasses ``HspmdError`` (the CLI prints it as one
line and exits 2), and ``ValueError`` too where the input is a value the user gave. The
four below are shared; the others live beside the module that raises them:

==================  =============================  ==================================
error               module                         bases
==================  =============================  ==================================
AnnotationError     hspmd.errors                   HspmdError, ValueError
ResolutionError     hspmd.errors                   HspmdError, ValueError
StrategyError       hspmd.errors                   HspmdError, ValueError
PartitionError      hspmd.errors                   HspmdError, ValueError
DataError           hspmd.data                     HspmdError, ValueError
ModelConfigError    hspmd.models.config            HspmdError, ValueError
CaptureError        hspmd.graph.capture            HspmdError, ValueError
ShapeError          hspmd.graph.shapes             HspmdError, ValueError
DeductionError      hspmd.deduce.rules             HspmdError, ValueError
NoRuleError         hspmd.deduce.rules             DeductionError
TopologyError       hspmd.comm.topology            HspmdError, ValueError
LocalizeError       hspmd.specialize.localize      HspmdError, ValueError
ScheduleError       hspmd.specialize.schedule      HspmdError, ValueError
BoundaryError       hspmd.specialize.boundary      HspmdError, ValueError
ExecutableError     hspmd.specialize.cut           HspmdError, ValueError
CheckpointError     hspmd.checkpoint.store         HspmdError, ValueError
ClusterError        hspmd.cost.cluster             HspmdError, ValueError
SwitchError         hspmd.switch.cost              HspmdError, ValueError
ExecuteError        hspmd.runtime.execute          HspmdError, ValueError
WorldError          hspmd.runtime.world            HspmdError, RuntimeError
LaunchError         hspmd.runtime.launch           HspmdError, RuntimeError
TrainError          hspmd.train.sections           HspmdError, ValueError
VocabLossError      hspmd.specialize.loss          HspmdError, ValueError
FusedInputError     hspmd.runtime.fused            HspmdError, ValueError
ProfileError        hspmd.cost.profile             HspmdError, ValueError
NoCostError         hspmd.cost.stage               HspmdError, ValueError
==================  =============================  ==================================

``hspmd.deduce.rules.RuleError`` and ``hspmd.deduce.axes.AxesError`` are internal: a
rule raises them for one axis and deduction re-raises them as a ``DeductionError`` that
names the node and its annotations.
"""


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
