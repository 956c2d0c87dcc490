//! The model side: a Llama-family model with trainable LoRA in candle, tokenizer and chat templates, adapters in PEFT format.
