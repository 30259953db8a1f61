"""Communication resolution: reshards become per-rank plans of collectives and BSR.

Pure data; nothing here touches torch.distributed.
"""
