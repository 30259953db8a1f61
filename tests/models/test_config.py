import subprocess
import sys

from hspmd.models import LlamaConfig, get_config, llama, parameter_shapes


def test_config_is_the_one_llama_uses() -> None:
    assert llama.LlamaConfig is LlamaConfig and llama.get_config is get_config
    assert llama.parameter_shapes is parameter_shapes


def test_planning_metadata_does_not_import_torch() -> None:
    code = (
        "import hspmd.models.config, hspmd.plan.params, hspmd.plan.schema, hspmd.comm.resolve, sys;"
        " print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
