#!/bin/bash
# Copies vLLM 0.33.0's server tests out of its sdist, changing only the model names
# (and EMBEDDING_SIZE, a property of the model) to cenote's local stand-ins.
set -euo pipefail
SRC=${1:?usage: copy_tests.sh VLLM_SDIST/tests/entrypoints}
DST=$(dirname "$0")/tests/entrypoints
FILES="pooling/embed/test_online.py pooling/embed/test_online_dimensions.py
pooling/classify/test_online.py pooling/scoring/test_cross_encoder_online.py
pooling/scoring/test_bi_encoder_online.py serve/tokenize/test_tokenization.py
openai/models/test_models.py openai/completion/test_completion.py
openai/chat_completion/test_chat.py"
for f in $FILES; do
  mkdir -p "$DST/$(dirname $f)"
  sed -e 's#"intfloat/multilingual-e5-small"#"sentence-transformers/all-MiniLM-L6-v2"#' \
      -e 's#"Snowflake/snowflake-arctic-embed-m-v1.5"#"sentence-transformers/all-MiniLM-L6-v2"#g' \
      -e 's#"BAAI/bge-base-en-v1.5"#"sentence-transformers/all-MiniLM-L6-v2"#' \
      -e 's#"BAAI/bge-reranker-base"#"cross-encoder"#' \
      -e 's#"jason9693/Qwen2.5-1.5B-apeach"#"classifier"#' \
      -e 's#"HuggingFaceTB/SmolLM2-135M-Instruct"#"SmolLM2-135M-Instruct.Q4_1.gguf"#' \
      -e 's#"Qwen/Qwen3-0.6B"#"SmolLM2-135M-Instruct.Q4_1.gguf"#' \
      -e 's#"HuggingFaceH4/zephyr-7b-beta"#"SmolLM2-135M-Instruct.Q4_1.gguf"#' \
      -e 's#^EMBEDDING_SIZE = 768#EMBEDDING_SIZE = 384#' \
      "$SRC/$f" > "$DST/$f"
done
find "$DST" -type d -exec touch {}/__init__.py \;
# The chat module's server fixture downloads a LoRA adapter; the shim drops LoRA flags.
sed -i -e '/from vllm.transformers_utils.repo_utils import hf_api/d' \
       -e 's|return hf_api().snapshot_download(repo_id="typeof/zephyr-7b-beta-lora")|return "/nonexistent/zephyr-lora"  # server fixture: cenote has no LoRA|' \
       "$DST/openai/chat_completion/test_chat.py"
# vLLM's shared sample fixtures (prompts, regex, JSON schema, choices) as they are
cp "$SRC/conftest.py" "$DST/conftest.py"
