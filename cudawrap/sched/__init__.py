"""Who gets which device and when: the rule, placement, selection, filters, drains, the queue, the acquirer."""
