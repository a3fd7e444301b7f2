/* Preloaded (LD_PRELOAD) into a server whose KV transfer address is loopback, so that Mooncake's listeners, which
 * bind every interface whatever address they are given, stay on this host: a bind to a wildcard address made from a
 * library under one of the folders in NPU_LLM_LOOPBACK_ONLY_FROM (':'-separated, resolved paths: Mooncake's package
 * and the libraries its wheel vendors) becomes a bind to loopback. IPv4 0.0.0.0 becomes 127.0.0.1; IPv6 :: becomes
 * ::ffff:127.0.0.1, on which a dual-stack socket (Mooncake's TCP transport) accepts IPv4 loopback connections, or
 * ::1 on an IPv6-only socket. Every other bind passes as it is: Triton's own ports go where --triton-host says.
 * See backend/engine/kv_transfer/loopback.py. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <limits.h>
#include <netinet/in.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

typedef int (*bind_fn)(int, const struct sockaddr *, socklen_t);

/* Found with dlsym by the process it is preloaded into: proof that the preload took (loopback.py). */
int npu_llm_loopback_only = 1;

static int called_from_scope(const void *caller) {
    const char *scopes = getenv("NPU_LLM_LOOPBACK_ONLY_FROM");
    Dl_info info;
    char path[PATH_MAX];
    if (!scopes || !*scopes || !dladdr(caller, &info) || !info.dli_fname || !realpath(info.dli_fname, path))
        return 0;
    for (const char *scope = scopes; *scope;) {
        const char *end = strchr(scope, ':');
        size_t length = end ? (size_t)(end - scope) : strlen(scope);
        if (length && strncmp(path, scope, length) == 0)
            return 1;
        scope += length + (end != NULL);
    }
    return 0;
}

int bind(int fd, const struct sockaddr *addr, socklen_t len) {
    static bind_fn real_bind;
    if (!real_bind)
        real_bind = (bind_fn)dlsym(RTLD_NEXT, "bind");
    if (!addr || !called_from_scope(__builtin_return_address(0)))
        return real_bind(fd, addr, len);
    if (addr->sa_family == AF_INET && len >= sizeof(struct sockaddr_in)) {
        struct sockaddr_in v4;
        memcpy(&v4, addr, sizeof v4);
        if (v4.sin_addr.s_addr == htonl(INADDR_ANY)) {
            v4.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
            return real_bind(fd, (const struct sockaddr *)&v4, sizeof v4);
        }
    } else if (addr->sa_family == AF_INET6 && len >= sizeof(struct sockaddr_in6)) {
        struct sockaddr_in6 v6;
        memcpy(&v6, addr, sizeof v6);
        if (IN6_IS_ADDR_UNSPECIFIED(&v6.sin6_addr)) {
            static const unsigned char mapped_loopback[16] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 127, 0, 0, 1};
            int v6_only = 0;
            socklen_t size = sizeof v6_only;
            getsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &v6_only, &size);
            if (v6_only)
                v6.sin6_addr = in6addr_loopback;
            else
                memcpy(&v6.sin6_addr, mapped_loopback, sizeof mapped_loopback);
            return real_bind(fd, (const struct sockaddr *)&v6, sizeof v6);
        }
    }
    return real_bind(fd, addr, len);
}
