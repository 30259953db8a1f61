"""Training data: the byte corpus by default, token files and tokenized text beside it.

============  ===========================================================================
module        what it holds
============  ===========================================================================
corpus        the byte corpus (UTF-8 bytes, vocabulary 256; the stdlib sources by default)
steps         steps of whole documents for variable-length training, from any corpus
tokens        token files, memory-mapped: flat ids (nanoGPT), ``.npy``, Megatron pairs
megatron      Megatron's indexed dataset (``.bin`` + ``.idx``), read and written
windows       fixed-length batches of a token file, drawn by (seed, step)
tokenizer     a user's tokenizer (``tokenizers`` / ``transformers``, imported lazily)
prepare       text tokenized into a token file, and the cache of ``train --tokenizer``
source        ``DataSpec``: which of these a run reads, and its checks before launch
============  ===========================================================================

docs/data.md shows them from the command line. The names of the byte corpus stay here:

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
from hspmd.data.source import DataSpec
from hspmd.data.steps import LONG_DOCS, DocumentStep

__all__ = [
    "DEFAULT_MAX_BYTES",
    "LONG_DOCS",
    "DataError",
    "DataSpec",
    "DocumentStep",
    "batches",
    "data_warnings",
    "document_steps",
    "documents",
    "load_documents",
    "split_documents",
]
