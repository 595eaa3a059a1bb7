"""LoRA adapters per request: PEFT folders read and checked (``adapter``), an adapter's own
classification head (``heads``), a checkpoint's own per-task adapters (``tasks``) and the
adapters resident on a model (``manager``). The request type, ``LoRARequest``, lives below the
config in ``cenote/lora_request.py``; the updates themselves run in the shared linear layers
(``cenote/models/layers/lora.py``)."""
