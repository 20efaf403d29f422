"""Models and what adapts them.

experts   mixture-of-experts models: the router's load-balancing loss and the experts' load, logged
loading   models and tokenizers, pretrained or built from a config, for any config
lora      --use_peft on any recipe: LoRA adapters, the merged export
"""
