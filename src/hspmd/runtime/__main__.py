"""``torchrun ... -m hspmd.runtime package.module:function [ARG...]``: run a worker function."""

import sys

from hspmd.runtime.launch import main

sys.exit(main())
