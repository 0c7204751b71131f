from megatron.core.models.gpt.model import GPTModel
