"""LoRA adapters per request: the request (``LoRARequest``), PEFT folders read and checked
(``adapter``), an adapter's own classification head (``heads``), and the adapters resident on a
model (``manager``). The updates themselves run in the shared linear layers
(``cenote/models/layers/lora.py``)."""
