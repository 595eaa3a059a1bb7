"""Test factories, one module per role. Everything is seeded and small enough for a 2-core box.

- ``vocab``: word-level tokenizers (``tokenizer.json``, or the files transformers saves too)
- ``seeded``: seeded random weights with noise on every parameter; config edits
- ``encoders``: BERT / RoBERTa / XLM-R / MPNet / DistilBERT folders (trunks, heads, masked LMs)
- ``encoder_zoo``: ModernBERT, NomicBERT and T5 encoder folders, and their texts
- ``decoders``: Llama / Qwen2 / Qwen3 folders (generation, pooling heads, Qwen2 reward)
- ``generation``: engines on those decoders, transformers references, the real SmolLM2
- ``st_folders``: sentence-transformers folders (SentenceTransformer, CrossEncoder, SparseEncoder)
- ``texts``: parity texts, prose, random token-id prompts
- ``gguf``: BERT-family GGUF files written as llama.cpp's converter writes them
- ``corpus``: corpus-job inputs and outputs
"""
