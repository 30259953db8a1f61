"""Pictures of plans and switches (matplotlib, Agg backend, imported only when drawing).

    draw_plan(explanation, "plan.png", kinds={0: "H800", ...})   # ranks x layers
    draw_switch(traffics, "switch.svg", cluster="h20x32")         # pair matrix + bars

``check_picture_path(path)`` refuses a path that is not ``.png`` or ``.svg`` (or whose folder
does not exist) before any work is done; the CLI calls it first.
"""

from hspmd.viz.common import PICTURE_FORMATS, PictureError, check_picture_path
from hspmd.viz.plan import draw_plan
from hspmd.viz.switch import draw_switch

__all__ = ["PICTURE_FORMATS", "PictureError", "check_picture_path", "draw_plan", "draw_switch"]
