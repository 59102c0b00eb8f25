"""The rotary scalings the tests turn K with, as transformers' ``rope_parameters`` (light to
import: tests/vllm must not import numba before vLLM starts, see tests/vllm/engines.py)."""

SCALINGS = {
    "none": {"rope_type": "default", "rope_theta": 100000.0},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    "llama3": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192},
    "yarn": {"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 4.0,
             "original_max_position_embeddings": 32768, "beta_fast": 32.0, "beta_slow": 1.0},
}
