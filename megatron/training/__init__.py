"""The MegatronDPP trainer on megatron.core."""
