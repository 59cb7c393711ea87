"""Generic helpers of the gateway with no domain of their own: identifiers, unread bytes."""
