"""The SGLang plugin's tests need SGLang 0.5.23, which the main environment does not carry: they
run in the environment .ci/sglang_env.sh builds over it (.ci/run does, after the vLLM plugin's).
Where SGLang is absent they are not collected at all, so the main test run neither imports nor
skips them. SGLang is imported only in worker processes, with the torchvision stand-in
(stand_ins/) first on their path; PYTHONPATH below carries it to them."""

import importlib.util
import os
from pathlib import Path

STAND_INS = Path(__file__).with_name("stand_ins")


def _have_sglang() -> bool:
    spec = importlib.util.find_spec("sglang")
    return spec is not None and spec.origin is not None  # a namespace folder named sglang is not it


collect_ignore_glob = ["stand_ins/*"] + ([] if _have_sglang() else ["*"])

if _have_sglang():
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(STAND_INS), *filter(None, [os.environ.get("PYTHONPATH")])])
