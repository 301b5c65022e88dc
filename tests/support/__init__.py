"""What many test packages share: real servers on free ports and an in-process stack."""
