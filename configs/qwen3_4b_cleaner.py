"""Paper run: qwen3_4b cleaner (docs/authors.md §4.1). Needs --config.model.path and
--config.data.train pointing at local files."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _paper import paper_config  # noqa: E402


def get_config():
    return paper_config(model="qwen3_4b", cleaner=True)
