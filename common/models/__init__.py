"""Models and what adapts them.

loading   models and tokenizers, pretrained or built from a config, for any config
lora      --use_peft on any recipe: LoRA adapters, the merged export
upcycle   a dense Llama-family model made a mixture of experts computing the same function (make real-moe)
"""
