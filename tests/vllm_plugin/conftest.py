"""The vLLM plugin's tests need vLLM 0.33.0, which the main environment does not carry: they run
in the environment .ci/vllm_env.sh builds over it (.ci/run does, after the main tests). Where vLLM
is absent they are not collected at all, so the main test run neither imports nor skips them."""

import importlib.util
import os
import shutil
import tempfile


def _have_vllm() -> bool:
    spec = importlib.util.find_spec("vllm")
    return spec is not None and spec.origin is not None  # a namespace folder named vllm is not it


collect_ignore_glob = [] if _have_vllm() else ["*"]


# vLLM names its ZeroMQ ipc sockets <VLLM_RPC_BASE_PATH>/<uuid> (the temp folder by default) and
# leaves them there: the workers, which inherit this environment, make theirs in a folder of the
# run's own, removed at the end.
_RPC_FOLDER = tempfile.mkdtemp(prefix="engramd-vllm-rpc-")
os.environ["VLLM_RPC_BASE_PATH"] = _RPC_FOLDER


def pytest_sessionfinish(session, exitstatus):
    shutil.rmtree(_RPC_FOLDER, ignore_errors=True)
