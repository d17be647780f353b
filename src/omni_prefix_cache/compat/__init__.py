"""The private names upstream's tests read or wrap, as aliases of the
components that own them. Nothing in the runtime calls them."""
