"""LoRA adapters over the base model: reading PEFT adapter directories (``adapter``), the
workers' device pool of adapter slots and the batched product the layers add (``pool``), and the
engine core's choice of which adapters are resident (``manager``)."""
