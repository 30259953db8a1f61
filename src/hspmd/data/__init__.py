"""Training data: the byte corpus (the default), and steps of whole documents.

============  ===========================================================================
module        what it holds
============  ===========================================================================
corpus        the byte corpus (UTF-8 bytes, vocabulary 256; the stdlib sources by default)
steps         steps of whole documents for variable-length training, from any corpus
============  ===========================================================================

The names of the byte corpus stay here:

>>> tokens, targets = next(batches(2, 8, seed=0, max_bytes=1 << 16))
>>> tokens.shape
torch.Size([2, 8])
"""

from hspmd.data.corpus import (
    DEFAULT_MAX_BYTES,
    batches,
    data_warnings,
    document_steps,
    documents,
    load_documents,
    split_documents,
)
from hspmd.data.errors import DataError
from hspmd.data.steps import LONG_DOCS, DocumentStep

__all__ = [
    "DEFAULT_MAX_BYTES",
    "LONG_DOCS",
    "DataError",
    "DocumentStep",
    "batches",
    "data_warnings",
    "document_steps",
    "documents",
    "load_documents",
    "split_documents",
]
