"""sparseprefill.integrations: run the sparse methods inside other libraries' models.

* `sparseprefill.integrations.transformers`: Hugging Face transformers models
  (Llama-, Qwen2-, Mistral-style decoders), through transformers'
  `AttentionInterface`; needs the `hf` extra (`pip install 'sparseprefill[hf]'`).

Submodules are imported on demand, so `import sparseprefill.integrations` never
imports a third-party library.
"""
