"""Who holds what: lease files, their holders, sharing slots, machine-wide claims."""
