"""Who holds what: lease files, their holders (and the processes on a device that are not), sharing slots, machine-wide claims."""
