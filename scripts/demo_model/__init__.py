"""Builds the bundled demo models (issue #9): data from Debian packages, a shared BPE tokenizer,
two small Llama models trained on CPU, their held-out evaluation and model cards.
Entry point: `python -m scripts.demo_model.build --out models`. Nothing here runs at serve time.
"""
