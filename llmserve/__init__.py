"""llmserve: an LLM inference server with a token-level KV cache and Triton kernels."""

from importlib.metadata import PackageNotFoundError, version

from llmserve.sampling_params import SamplingParams

try:
    __version__ = version("llmserve")
except PackageNotFoundError:   # running from a source tree that was never installed
    __version__ = "0.0.0+local"

__all__ = ["LLM", "RequestOutput", "SamplingParams"]


def __getattr__(name: str):
    # Lazy: `import llmserve` stays cheap for worker processes and the CLI's --help.
    if name in ("LLM", "RequestOutput"):
        from llmserve import llm

        return getattr(llm, name)
    raise AttributeError(name)
