"""Host-side file tools on a ticket's workspace (R17-R19), its disk cap (R34) and the
workspace across hosts."""
