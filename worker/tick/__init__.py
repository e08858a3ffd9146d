"""The tick loop and its phases: intake, KV moves, drafting, fault injection, and the watchdog
that exits the process when a tick stalls."""
